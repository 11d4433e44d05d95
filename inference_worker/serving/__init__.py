"""Between HTTP and the engine: the model service (one model thread), its batch scheduler, request validation and image decoding."""
