"""The OCR engine: RapidOCR reading, screen concepts from the text, OCR grounding for model engines."""
