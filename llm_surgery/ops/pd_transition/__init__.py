"""`pd_transition`: Flash PD-SSM's per-token transition (selected member and diagonal D) from the layer's
projection, fused: one kernel reads the projection once and writes D's planes, the selected member and P_t;
one kernel turns the scan's gradients back into the projection's. `naive.py` is the torch reference."""

from .naive import round_phase, snap_magnitude, transition_naive

__all__ = ["round_phase", "snap_magnitude", "transition_naive"]
