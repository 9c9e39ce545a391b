"""The demo agent that `make run` ships: a scripted model, one tool call, a final answer."""
