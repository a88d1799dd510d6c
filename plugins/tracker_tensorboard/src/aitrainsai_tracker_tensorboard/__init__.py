"""The TensorBoard experiment tracker."""
