"""asyncps ps role."""
