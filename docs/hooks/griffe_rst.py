"""A Griffe extension that turns gpattn's reST docstring markup into the Markdown the site renders.

gpattn writes its docstrings the way GPyTorch does (Sphinx fields ``:param x:``, ``:return:``, ``:ivar x:``, roles
``:math:`...```, ``:class:`~gpattn.x.Y```, directives ``.. math::``, ``.. note::``). mkdocstrings parses the fields
(``docstring_style: auto``) but renders the rest as Markdown, so before parsing this extension rewrites:

* ``:math:`x``` -> ``\\(x\\)`` and ``.. math::`` blocks -> ``$$ ... $$`` (``pymdownx.arithmatex``, rendered by
  MathJax; multi-line equations with ``&`` become an ``aligned`` environment);
* ``:class:``/``:func:``/``:meth:``/``:attr:``/... -> a link when the target is rendered on the API pages
  (mkdocs-autorefs), else inline code, so that a strict build never meets an unresolvable reference;
* ``.. note::`` -> a Material admonition, ``para::`` literal blocks -> fenced code;
* fields followed by more prose: the prose is moved before the fields (reST ends a field body at the first
  unindented line; Griffe's Sphinx parser would append it to the last field);
* methods without a docstring inherit the one of the gpattn method they override (as ``inspect.getdoc`` does);
* module attributes documented by a ``#:`` comment (Sphinx's convention) get it as their docstring.

The extension is configured in ``mkdocs.yml`` (``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

# every public subpackage of gpattn, read from the source tree (the hook must not import gpattn and torch)
SUBPACKAGES = tuple(
    sorted(
        path.name
        for path in (Path(__file__).resolve().parents[2] / "gpattn").iterdir()
        if (path / "__init__.py").is_file() and not path.name.startswith("_")
    )
)
# objects rendered on a page of their own besides the subpackages' ``__all__`` (lazily exported names)
EXTRA_RENDERED = ("training.distributed",)

ROLE = re.compile(r":(?P<role>class|func|meth|attr|data|mod|exc|obj|const):`(?P<target>[^`]+)`")
MATH_ROLE = re.compile(r":math:`(?P<tex>[^`]+)`")
FIELD = re.compile(
    r"^:(param|parameter|arg|argument|key|keyword|type|ivar|var|cvar|vartype|return|returns|rtype|raise|raises|"
    r"except|exception)\b[^:]*:"
)
DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (?P<name>math|note|warning|seealso)::\s?(?P<rest>.*)$")
EXTERNAL = ("torch", "gpytorch", "linear_operator", "pyro", "numpy", "sklearn", "matplotlib", "scipy")
# docstrings cite the specification as "docs/math.md section N" (or "docs/math.md section 6, identity N"); the
# specification's sections carry the anchors spec-section-N
MATH_REFERENCE = re.compile(r"docs/math\.md section (?P<number>\d+)(?P<identity>, identity \d+)?")
ADMONITIONS = {"note": "note", "warning": "warning", "seealso": "info"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# -- blocks -----------------------------------------------------------------------------------------------------------
def _block_body(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """Lines after ``start`` indented deeper than ``indent`` (blank lines inside kept); returns them and the index of
    the first line after the block."""
    end = start
    body = []
    while end < len(lines):
        line = lines[end]
        if line.strip() and _indent(line) <= indent:
            break
        body.append(line)
        end += 1
    while body and not body[-1].strip():
        body.pop()
        end -= 1
    return body, end


def _dedent(body: list[str]) -> list[str]:
    width = min((_indent(line) for line in body if line.strip()), default=0)
    return [line[width:] if line.strip() else "" for line in body]


def _math_block(tex_lines: list[str], indent: str) -> list[str]:
    tex = "\n".join(line for line in _dedent(tex_lines)).strip("\n")
    if "\\begin{" not in tex and ("&" in tex or "\\\\" in tex):
        environment = "aligned" if "&" in tex else "gathered"
        tex = f"\\begin{{{environment}}}\n{tex}\n\\end{{{environment}}}"
    return ["", f"{indent}$$"] + [f"{indent}{line}" if line else "" for line in tex.split("\n")] + [f"{indent}$$", ""]


def _convert_directives(lines: list[str]) -> list[str]:
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        match = DIRECTIVE.match(line)
        if match is None:
            literal = line.rstrip().endswith("::") and not line.strip().startswith("..")
            if literal:
                body, end = _block_body(lines, index + 1, _indent(line))
                if any(text.strip() for text in body):
                    indent = " " * _indent(line)
                    text = line.rstrip()[:-1]  # "para::" -> "para:"
                    out += [text, "", f"{indent}```text"]
                    out += [f"{indent}{code}" if code else "" for code in _dedent(body)]
                    out += [f"{indent}```", ""]
                    index = end
                    continue
            out.append(line)
            index += 1
            continue
        indent, name, rest = match["indent"], match["name"], match["rest"].strip()
        body, end = _block_body(lines, index + 1, len(indent))
        content = ([rest] if rest else []) + _dedent(body)
        if name == "math":
            out += _math_block(content, indent)
        else:
            out += ["", f"{indent}!!! {ADMONITIONS[name]}"]
            out += [f"{indent}    {text}" if text else "" for text in content]
            out.append("")
        index = end
    return out


def _fields_last(lines: list[str]) -> list[str]:
    """Move prose that follows the fields in front of them (a field body is its indented continuation lines)."""
    prose: list[str] = []
    fields: list[str] = []
    in_field = False
    for line in lines:
        if FIELD.match(line):
            in_field = True
            fields.append(line)
        elif in_field and (not line.strip() or line[:1].isspace()):
            fields.append(line)
        else:
            in_field = False
            prose.append(line)
    if not fields:
        return lines
    while fields and not fields[-1].strip():
        fields.pop()
    while prose and not prose[-1].strip():
        prose.pop()
    return prose + [""] + fields if prose else fields


# -- references -------------------------------------------------------------------------------------------------------
class _References:
    """Maps reference targets to the identifiers of the API reference's anchors."""

    def __init__(self, package: griffe.Module):
        self.package = package
        self.public: dict[str, str] = {}  # canonical path -> rendered path
        for name in (*SUBPACKAGES, *EXTRA_RENDERED):
            module = package.get_member(name)
            exports = (
                module.exports
                if name in SUBPACKAGES
                else [member for member, value in module.members.items() if value.is_public and not value.is_alias]
            )
            for export in exports or ():
                if export not in module.all_members:
                    continue  # exported lazily (``__getattr__``): rendered from its own module (EXTRA_RENDERED)
                try:
                    canonical = module[export].canonical_path
                except griffe.AliasResolutionError:
                    continue
                self.public.setdefault(canonical, f"{module.path}.{export}")
        for name in SUBPACKAGES:
            self.public.setdefault(f"{package.path}.{name}", f"{package.path}.{name}")

    def _lookup(self, path: str) -> Any | None:
        try:
            return self.package.modules_collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None

    def rendered_path(self, target: str, scope: griffe.Object) -> str | None:
        candidates = [target]
        if not target.startswith(f"{self.package.path}."):
            owners = [scope] + [parent for parent in _parents(scope)]
            candidates = [f"{owner.path}.{target}" for owner in owners if owner.is_class or owner.is_module]
        for candidate in candidates:
            obj = self._lookup(candidate)
            if obj is None:
                continue
            try:
                canonical = obj.canonical_path
            except griffe.AliasResolutionError:
                return None
            if canonical in self.public:
                return self.public[canonical]
            parent, _, member = canonical.rpartition(".")
            if parent in self.public and not member.startswith("_") and _has_docstring(obj):
                return f"{self.public[parent]}.{member}"
            return None
        return None

    def replace(self, match: re.Match[str], scope: griffe.Object) -> str:
        role, target = match["role"], match["target"].strip()
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", target)
        if explicit:
            title, target = explicit["title"], explicit["target"]
        else:
            title = target.lstrip("~").rsplit(".", 1)[-1] if target.startswith("~") else target
            if role in ("func", "meth"):
                title += "()"
        target = target.lstrip("~")
        rendered = None if target.split(".")[0] in EXTERNAL else self.rendered_path(target, scope)
        return f"[`{title}`][{rendered}]" if rendered else f"`{title}`"


def _parents(obj: griffe.Object) -> list[griffe.Object]:
    parents = []
    while obj.parent is not None:
        obj = obj.parent
        parents.append(obj)
    return parents


def _has_docstring(obj: Any) -> bool:
    try:
        return bool(obj.docstring and obj.docstring.value.strip())
    except griffe.AliasResolutionError:
        return False


def _shadow_submodules(package: griffe.Module) -> None:
    """``from .kernel_svd import kernel_svd`` in ``gpattn/ksvd/__init__.py`` makes ``gpattn.ksvd.kernel_svd`` the
    function at runtime, but Griffe keeps the submodule under that name (and would render nothing for it): point
    the name at the function, as Python does."""
    for name in SUBPACKAGES:
        module = package.get_member(name)
        for export in module.exports or ():
            member = module.members.get(export)
            if member is not None and not member.is_alias and member.is_module and export in member.members:
                for other in module.members.values():  # resolve the other exports first: they may go through it
                    if other.is_alias:
                        try:
                            _ = other.target
                        except griffe.AliasResolutionError:
                            pass
                function = member.members[export]
                module.members[export] = griffe.Alias(export, function, parent=module)


# -- the extension ----------------------------------------------------------------------------------------------------
def _walk(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found += _walk(member)
    return found


def _inherit_docstring(function: griffe.Object) -> None:
    owner = function.parent
    if not (owner is not None and owner.is_class) or _has_docstring(function):
        return
    for base in owner.mro():
        candidate = base.members.get(function.name)
        if candidate is not None and not candidate.is_alias and _has_docstring(candidate):
            function.docstring = griffe.Docstring(
                candidate.docstring.value, parent=function, parser=candidate.docstring.parser
            )
            return


def _comment_docstring(attribute: griffe.Object) -> None:
    if _has_docstring(attribute) or not attribute.lineno or attribute.parent is None:
        return
    try:
        lines = attribute.parent.lines_collection[attribute.filepath]
    except (KeyError, AttributeError):
        return
    comment: list[str] = []
    index = attribute.lineno - 2  # the line above the assignment (lineno is 1-based)
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        comment.insert(0, lines[index].lstrip()[2:].strip())
        index -= 1
    if comment:
        attribute.docstring = griffe.Docstring(" ".join(comment), parent=attribute)


def _math_reference(match: re.Match[str]) -> str:
    number, identity = match["number"], match["identity"] or ""
    return f"[docs/math.md section {number}{identity}][spec-section-{number}]"


def convert(text: str, scope: griffe.Object, references: _References) -> str:
    """The Markdown of one reST docstring."""
    text = MATH_REFERENCE.sub(_math_reference, text)
    text = MATH_ROLE.sub(lambda match: f"\\({match['tex']}\\)", text)
    text = ROLE.sub(lambda match: references.replace(match, scope), text)
    lines = _convert_directives(text.split("\n"))
    return "\n".join(_fields_last(lines))


class ReSTToMarkdown(griffe.Extension):
    """Rewrites the docstrings of the ``gpattn`` package once it is loaded (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "gpattn":
            return
        objects = _walk(pkg)
        for obj in objects:
            if obj.is_function:
                _inherit_docstring(obj)
            elif obj.is_attribute and obj.parent is not None and obj.parent.is_module:
                _comment_docstring(obj)
        _shadow_submodules(pkg)
        references = _References(pkg)
        converted: set[int] = set()
        for obj in objects:
            docstring = obj.docstring
            if docstring is None or id(docstring) in converted:
                continue
            converted.add(id(docstring))
            docstring.value = convert(docstring.value, obj, references)
