"""Every import cycle among a package's modules, from the import graph grimp draws
(the library import-linter is built on).

    python bench/import_cycles.py                      # chatcore, type-checking imports included
    python bench/import_cycles.py --runtime-only       # imports under `if TYPE_CHECKING:` left out
    python bench/import_cycles.py --edges              # and the imports that make each cycle

A cycle is a strongly connected group of modules: each reaches every other through
imports (at module level or inside a function, where grimp sees both). Prints one line
per group, largest first, and the count; exits 0 either way (docs/measurements.md keeps
the numbers).
"""

from __future__ import annotations

import argparse

import grimp
import networkx


def import_cycles(package: str, runtime_only: bool) -> tuple[grimp.ImportGraph, list[list[str]], networkx.DiGraph]:
    graph = grimp.build_graph(package, exclude_type_checking_imports=runtime_only, cache_dir=None)
    directed = networkx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            directed.add_edge(module, imported)
    groups = [sorted(group) for group in networkx.strongly_connected_components(directed) if len(group) > 1]
    return graph, sorted(groups, key=lambda group: (-len(group), group)), directed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", default="chatcore")
    parser.add_argument("--runtime-only", action="store_true", help="leave out imports under TYPE_CHECKING")
    parser.add_argument("--edges", action="store_true", help="print the imports inside each cycle")
    args = parser.parse_args()
    graph, groups, directed = import_cycles(args.package, args.runtime_only)
    for group in groups:
        print(f"{len(group)} modules: {', '.join(group)}")
        if args.edges:
            for importer in group:
                for imported in group:
                    if directed.has_edge(importer, imported):
                        lines = graph.get_import_details(importer=importer, imported=imported)
                        where = ", ".join(str(detail["line_number"]) for detail in lines)
                        print(f"    {importer} -> {imported} (line {where})")
    print(f"{len(groups)} cycle(s) in {len(graph.modules)} modules of {args.package}")


if __name__ == "__main__":
    main()
