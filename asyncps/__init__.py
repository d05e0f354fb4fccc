"""asyncps: a parameter-server training system for asynchronous SGD with staleness tracking."""
