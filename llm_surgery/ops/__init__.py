"""The new science as plain ops: the PD recurrence and its straight-through selection."""

from .pd_scan import pd_scan, pd_scan_backward
from .pd_select import pd_select_scan

__all__ = ["pd_scan", "pd_scan_backward", "pd_select_scan"]
