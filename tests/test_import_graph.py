"""The package's modules import each other without circles, counting imports inside functions
too (a circle hidden behind a function-level import is still a circle)."""

import ast
import pathlib

import jax_megamoe

PACKAGE = pathlib.Path(jax_megamoe.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph: dict[str, set[str]] = {name: set() for name in modules}
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from pkg import mod` imports the submodule pkg.mod when there is one.
        targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                   else node.module for alias in node.names]
      for target in targets:
        # A package is an implicit parent of its own modules' imports: not an edge of theirs.
        if target in modules and target != name and not name.startswith(target + "."):
          graph[name].add(target)
  return graph


def _cycle(graph):
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_graph_sees_function_level_imports():
  graph = _import_graph()
  # symmetric loads the extension inside a function: the walker must see it.
  assert "jax_megamoe._ffi" in graph["jax_megamoe.symmetric"]
  assert "jax_megamoe.backends.cuda_ep" in graph["jax_megamoe.backends.cuda"]


def test_no_import_circles():
  cycle = _cycle(_import_graph())
  assert cycle is None, " -> ".join(cycle)
