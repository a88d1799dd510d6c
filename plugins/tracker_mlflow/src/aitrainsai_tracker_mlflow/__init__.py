"""The ``mlflow`` experiment tracker (MLflow is imported only when a tracker starts)."""
