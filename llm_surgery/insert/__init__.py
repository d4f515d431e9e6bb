"""The surgery: insert new mixer layers in front of a frozen hybrid host's attention blocks, save and load them."""

from .block import InsertedBlock
from .checkpoint import load_inserted, read_inserted_config, save_inserted
from .state import keep_state_history
from .surgery import (LayerSpec, count_parameters, insert_layers, inserted_layers, inserted_specs, remove_inserted,
                      set_tau)

__all__ = ["InsertedBlock", "LayerSpec", "count_parameters", "insert_layers", "inserted_layers", "inserted_specs",
           "keep_state_history", "load_inserted", "read_inserted_config", "remove_inserted", "save_inserted", "set_tau"]
