"""HTTP: the FastAPI app and its gates (app.py), routes and streaming, the key and state file (auth.py), uvicorn's
transport errors (h11_errors.py), and the worker process lifetime."""
