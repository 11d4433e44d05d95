"""The app's side of the worker process: starting and watching it (supervisor), asking it (client, output mode)."""
