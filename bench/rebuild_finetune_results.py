"""One-off: rebuild box_scale's finetune-*.json files from the trainer runs' own results.json, for a device call
that returned only 8 of its files (its finetune JSONs were among those left behind). The set strings are the
ones that call passed (.dev/box.sh); everything else is read from each run's results.json."""
import json
import sys
from pathlib import Path

runs_dir, host_state, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
ID, PM = {"mixer_options": '{"dict_init": "identity"}'}, {"mixer_options": '{"dict_init": "permutation"}'}
SETS = {"exact-identity": ID, "exact-identity-lr3e-4": {"lr": 0.0003, **ID}, "exact-identity-lr1e-4": {"lr": 0.0001, **ID},
        "exact-permutation": PM, "exact-permutation-lr3e-4": {"lr": 0.0003, **PM},
        "exact-identity-n1p0": {"n": 1, "positions": [0], **ID}, "rerun": {}}
state = json.loads(host_state.read_text())
out.mkdir(parents=True, exist_ok=True)
for res in sorted(runs_dir.glob("w_*/*/results.json")):
    tag, kind, seed = res.parent.parent.name[2:].rsplit("_", 2)
    r = json.loads(res.read_text())
    cfg = r["config"]
    assert cfg["kind"] == kind and cfg["seed"] == int(seed), res
    for k, v in SETS[tag].items():  # the recorded set must be what the run's config says
        assert cfg[k] == v, (res, k, cfg[k], v)
    recipe = {k: cfg[k] for k in ("weight_decay", "warmup_ratio", "lr", "schedule", "tau", "tau_end")}
    result = {"host": {"fingerprint": state["fingerprint"], "step": state["step"], "spec": state["spec"]},
              "recipe": {"name": "granite350m", "n": 4, **recipe, "lr": 0.001, "steps": cfg["max_steps"],
                         "batch": cfg["batch_size"]},
              "set": SETS[tag], "device": "NVIDIA H100 80GB HBM3",
              "runs": [{"kind": kind, "seed": int(seed), "set": SETS[tag], "test": r["test"],
                        "host_alone": r["host_alone"], "params": r["params"], "seconds": None,
                        "tokens_per_s": r["throughput"]["tokens_per_s_per_process"]}]}
    (out / f"finetune-{kind}-s{seed}-{tag}.json").write_text(json.dumps(result, indent=1))
    print(out / f"finetune-{kind}-s{seed}-{tag}.json")
