"""The inference worker: a separate process that owns the model and serves OpenAI chat completions.

Importing this package is cheap and never imports torch; engines load lazily.
"""

__version__ = "0.1.0"
