"""Pieces shared by the worker services (engine thread, option parsing)."""
