"""Between HTTP and the engine: the model service (one model thread) and its batch scheduler."""
