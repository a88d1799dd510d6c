"""aitrainsai view: a local, read-only web viewer over a runs directory."""
