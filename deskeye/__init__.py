"""DeskEye: a private desktop assistant that describes a region of the screen.

Data flows one way, and the folders follow it: `see/` (grab, change, privacy, the windows in the region) ->
`ask/` (route the question, quick answers, memory) -> `worker/` (the model's process, and the client that asks it)
-> `ui/` (overlay, tray) and `hooks/`. `compose.py` builds the parts from the settings, `app.py` runs them. This
package never imports torch, nor the worker's code.
"""

__version__ = "0.1.0"
