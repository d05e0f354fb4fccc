"""asyncps worker role."""
