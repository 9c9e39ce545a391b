"""Model providers behind one small Protocol (see `base.Provider`)."""
