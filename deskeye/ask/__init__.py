"""Asking: which tier answers a question, the quick answers that need no model, memory, and two-stage answers."""
