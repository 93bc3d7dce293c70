"""``foretell plugins``: what is installed, what loaded, what each contributes."""

from __future__ import annotations

import json

from foretell.plugin.loader import LOADED, PluginSet, load_plugins


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list plugins, their status and contributions")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(handler=run)


def describe(plugins: PluginSet) -> dict:
    replaced = {(r.replaced.kind, r.replaced.name): r for r in plugins.registry.replacements}
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
    conflicts = [c.message() for c in plugins.registry.conflicts.values()]
    return {"plugins": rows, "conflicts": conflicts}


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
            summary = f" - {c['summary']}" if c["summary"] else ""
            lines.append(f"    {c['kind']}:{c['name']}{summary}{note}")
    for message in listing["conflicts"]:
        lines.append(f"CONFLICT: {message}")
    return "\n".join(lines)


def run(args) -> int:
    listing = describe(load_plugins())
    print(json.dumps(listing, indent=2) if args.json else render(listing))
    return 0
