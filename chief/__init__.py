"""asyncps chief role."""
