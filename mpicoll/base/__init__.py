"""Base utilities any layer may use: settings, errors, tags, chunking, the timeline, ending a job,
checkpoint files, launchers, stragglers, UCX defaults.  Nothing here calls a collective."""
