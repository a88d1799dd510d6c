"""aitrainsai-backend-runpod: inner jobs on a warm pool of Runpod GPU pods, over SSH."""
