"""Automation hooks: rules (what a hook may say), terms (whole-word and Chinese-term matching), titles (what a
notification calls a rule, in the user's language), cooldowns (per rule and object), the runner (firing them safely),
loading them from the settings."""
