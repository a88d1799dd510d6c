"""Isolation of agent code: what a job may see (:mod:`aitrainsai.isolation.view`). The sandbox strategies that
apply it are in :mod:`aitrainsai.sandbox` for now."""
