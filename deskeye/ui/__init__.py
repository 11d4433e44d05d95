"""What the user sees and presses: the overlay and Ask box, the tray and its menu, hotkeys, notifications."""
