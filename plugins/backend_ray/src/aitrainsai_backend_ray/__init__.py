"""aitrainsai GPU backend on Ray."""
