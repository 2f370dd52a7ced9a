"""Runners turn a parsed task and a workspace into a finished process (DESIGN.md §3)."""
