"""The Weights & Biases tracker."""
