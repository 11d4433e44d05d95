"""Seeing: grab the watched region, tell a meaningful change, keep private windows and DeskEye's own out."""
