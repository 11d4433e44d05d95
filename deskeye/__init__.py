"""DeskEye: a private desktop assistant that describes a region of the screen.

Data flows one way: capture -> route -> worker -> overlay / hooks. This package never imports torch.
"""

__version__ = "0.1.0"
