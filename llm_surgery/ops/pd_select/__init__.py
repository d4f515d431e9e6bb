"""Straight-through hard selection of Flash PD-SSM transitions from a trainable dictionary."""

from .function import column_argmax, gather_transitions, pd_select_scan
from .naive import pd_select_scan_dense

__all__ = ["pd_select_scan", "pd_select_scan_dense", "column_argmax", "gather_transitions"]
