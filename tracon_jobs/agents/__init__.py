"""Agents from configuration, and the tools they may call."""
