"""HTTP: the app, its routes and gates (Host, bearer key), and the worker process lifetime."""
