"""``foretell plugins``: what is installed, what loaded, what each contributes."""

from __future__ import annotations

import json

from foretell.plugin.loader import LOADED, PluginSet, load_plugins
from foretell.plugin.registry import Kind


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list plugins, their status and contributions")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(handler=run)


def describe(plugins: PluginSet) -> dict:
    registry = plugins.registry
    replaced = {(r.replaced.kind, r.replaced.name): r for r in registry.replacements}
    shadowed = {id(s.fallback): s.native for s in registry.shadowed}
    rows = []
    for record in plugins.records:
        contributes = []
        for item in record.contributions:
            entry = {"kind": item.kind.value, "name": item.name, "summary": item.summary}
            swap = replaced.get((item.kind, item.name))
            if swap is not None and swap.winner is item:
                entry["replaces"] = swap.replaced.origin.plugin
            elif swap is not None and swap.replaced is item:
                entry["replaced_by"] = swap.winner.origin.plugin
            if item.fallback:
                entry["fallback"] = True
                if id(item) in shadowed:
                    entry["served_by"] = shadowed[id(item)].origin.plugin
            contributes.append(entry)
        rows.append(
            {
                "name": record.name,
                "distribution": record.distribution,
                "version": record.version,
                "kind": record.kind,
                "status": record.status,
                "error": record.error,
                "contributes": contributes,
            }
        )
    conflicts = [c.message() for c in registry.conflicts.values()]
    # Which plugin a model directory of each model_type gets (a native one over a fallback).
    serves = {name: {"plugin": item.origin.plugin, "fallback": item.fallback}
              for name, item in registry.served_by(Kind.ARCHITECTURE).items()}
    return {"plugins": rows, "conflicts": conflicts, "model_types": serves}


def render(listing: dict) -> str:
    lines = []
    for row in listing["plugins"]:
        dist = f"{row['distribution']} {row['version']}" if row["distribution"] else "-"
        status = row["status"] if row["status"] == LOADED else row["status"].upper()
        lines.append(f"{row['name']}  [{row['kind']}]  {dist}  {status}")
        if row["error"]:
            lines.append(f"    error: {row['error']}")
        for c in row["contributes"]:
            note = ""
            if "replaces" in c:
                note = f"  (replaces built-in from '{c['replaces']}')"
            elif "replaced_by" in c:
                note = f"  (replaced by '{c['replaced_by']}')"
            elif "served_by" in c:
                note = f"  (fallback; '{c['served_by']}' serves it natively)"
            elif c.get("fallback"):
                note = "  (fallback)"
            summary = f" - {c['summary']}" if c["summary"] else ""
            lines.append(f"    {c['kind']}:{c['name']}{summary}{note}")
    for message in listing["conflicts"]:
        lines.append(f"CONFLICT: {message}")
    by_plugin: dict[str, list[str]] = {}
    for model_type, served in sorted(listing["model_types"].items()):
        by_plugin.setdefault(served["plugin"], []).append(model_type)
    if by_plugin:
        lines.append("model types, by the plugin that serves them:")
        for plugin, types in by_plugin.items():
            lines.append(f"    {plugin}: {', '.join(types)}")
    return "\n".join(lines)


def run(args) -> int:
    listing = describe(load_plugins())
    print(json.dumps(listing, indent=2) if args.json else render(listing))
    return 0
