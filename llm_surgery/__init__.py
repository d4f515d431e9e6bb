"""llm-surgery: splice new sequence mixers (Flash PD-SSM, Mamba2, DeltaNet) into frozen hybrid LLMs."""

__version__ = "0.1.0"

_LAZY = {"insert_layers": "insert", "save_inserted": "insert", "load_inserted": "insert",
         "remove_inserted": "insert", "inserted_layers": "insert", "set_tau": "insert", "count_parameters": "insert",
         "keep_state_history": "insert",
         "pd_scan": "ops", "pd_select_scan": "ops", "FlashPDSSM": "layers", "build_mixer": "layers"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    """Import on first use, so `import llm_surgery` stays light and never needs GPU-only packages."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
