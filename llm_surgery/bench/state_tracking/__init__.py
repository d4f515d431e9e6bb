"""Synthetic state-tracking benchmark: tasks, a small classifier, training and evaluation."""
