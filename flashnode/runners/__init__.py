"""Runners turn a parsed task and a workspace into a finished process (docs/design.md §3)."""
