"""Checks the shared libraries in wheels against a manylinux policy.

    python .ci/check_symbol_versions.py [--policy manylinux_2_27] WHEEL...

For each wheel it checks that its name carries a platform tag at or below the
policy (auditwheel repair picks the lowest one the symbols allow), and for
each ELF file in it prints the highest GLIBC_, GLIBCXX_,
CXXABI_ and GCC_ symbol version it needs, and fails when:

- one is newer than the policy allows (auditwheel's own policy table, for the
  file's architecture: GLIBC_2.27, GLIBCXX_3.4.24, CXXABI_1.3.11 and GCC_7.0.0
  for manylinux_2_27);
- it needs a symbol without a version that is not weak and not Python's
  (Py*, _Py*): such a symbol was missing from the libraries it was linked
  against (Zig's glibc 2.27 stubs) and would fail to load, or bind to
  whatever the process holds, on the oldest systems;
- it exports anything but its module's PyInit_ function: the wheels link
  libstdc++ statically, whose symbols must stay inside the module.

Run by .ci/build_wheel.sh (so by `make wheel` and .ci/run) after
`auditwheel show`, with the build venv's Python (auditwheel, pyelftools).
"""

import argparse
import io
import json
import re
import sys
import zipfile
from importlib import resources

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

PREFIXES = ('GLIBC', 'GLIBCXX', 'CXXABI', 'GCC')
ARCHES = {'EM_X86_64': 'x86_64', 'EM_AARCH64': 'aarch64'}
PYTHON_SYMBOL = re.compile(r'_?Py')
# PEP 600's names of the older manylinux tags.
LEGACY_TAGS = {
  'manylinux1': (2, 5),
  'manylinux2010': (2, 12),
  'manylinux2014': (2, 17),
}


def glibc_of_tag(tag: str) -> tuple[int, int] | None:
  """(2, 27) for 'manylinux_2_27_x86_64' or the policy 'manylinux_2_27'."""
  match = re.match(r'manylinux_(\d+)_(\d+)', tag)
  if match:
    return int(match[1]), int(match[2])
  return LEGACY_TAGS.get(tag.split('_')[0])


def check_wheel_name(wheel: str, policy: str) -> list[str]:
  """A failure unless the wheel's lowest platform tag is at most POLICY's."""
  platforms = wheel.rsplit('/', 1)[-1].removesuffix('.whl').split('-')[-1]
  glibcs = [g for t in platforms.split('.') if (g := glibc_of_tag(t))]
  print(f'{wheel}: platform {platforms}')
  if glibcs and min(glibcs) <= glibc_of_tag(policy):
    return []
  return [f'{wheel}: tagged {platforms}, not {policy} or lower']


def version_key(name: str) -> tuple[int, ...]:
  """Orders 'GLIBC_2.3.4' < 'GLIBC_2.27' by the numbers after the last '_'."""
  return tuple(int(part) for part in name.split('_')[-1].split('.'))


def is_numbered(name: str) -> bool:
  """'GLIBC_2.27', not 'GLIBC_PRIVATE'."""
  return re.fullmatch(r'[A-Z]+_\d+(\.\d+)*', name) is not None


def policy_limits(policy: str, arch: str) -> dict[str, str]:
  """The highest version of each prefix that auditwheel's POLICY allows."""
  text = (
    resources.files('auditwheel.policy')
    .joinpath('manylinux-policy.json')
    .read_text()
  )
  for entry in json.loads(text):
    if policy in [entry['name'], *entry.get('aliases', [])]:
      versions = entry['symbol_versions'][arch]
      return {
        prefix: max(
          (
            f'{prefix}_{v}'
            for v in versions.get(prefix, [])
            if is_numbered(f'{prefix}_{v}')
          ),
          key=version_key,
        )
        for prefix in PREFIXES
        if any(is_numbered(f'{prefix}_{v}') for v in versions.get(prefix, []))
      }
  raise SystemExit(f'auditwheel has no policy named {policy!r}')


def needed_versions(elf: ELFFile) -> dict[str, str]:
  """The highest version the file needs of each prefix in PREFIXES."""
  highest: dict[str, str] = {}
  for section in elf.iter_sections():
    if not isinstance(section, GNUVerNeedSection):
      continue
    for _, auxiliaries in section.iter_versions():
      for auxiliary in auxiliaries:
        name = auxiliary.name
        prefix = name.rsplit('_', 1)[0]
        if not is_numbered(name):
          continue
        if prefix in PREFIXES and (
          prefix not in highest
          or version_key(name) > version_key(highest[prefix])
        ):
          highest[prefix] = name
  return highest


def needed_libraries(elf: ELFFile) -> list[str]:
  """The file's DT_NEEDED entries."""
  for section in elf.iter_sections():
    if isinstance(section, DynamicSection):
      return [
        tag.needed
        for tag in section.iter_tags()
        if tag.entry.d_tag == 'DT_NEEDED'
      ]
  return []


def symbol_problems(elf: ELFFile) -> list[str]:
  """Unversioned strong imports that are not Python's; non-PyInit_ exports."""
  symbols = elf.get_section_by_name('.dynsym')
  versions = elf.get_section_by_name('.gnu.version')
  problems = []
  for index, symbol in enumerate(symbols.iter_symbols()):
    name, bind = symbol.name, symbol['st_info']['bind']
    if not name or bind == 'STB_LOCAL':
      continue
    if symbol['st_shndx'] == 'SHN_UNDEF':
      # Index 0 and 1 are VER_NDX_LOCAL and VER_NDX_GLOBAL: no version.
      ndx = versions.get_symbol(index)['ndx'] if versions else 1
      unversioned = ndx in (0, 1, 'VER_NDX_LOCAL', 'VER_NDX_GLOBAL')
      if unversioned and bind != 'STB_WEAK' and not PYTHON_SYMBOL.match(name):
        problems.append(f'imports {name} without a version')
    elif not name.startswith('PyInit_'):
      problems.append(f'exports {name}')
  return problems


def check_library(name: str, data: bytes, policy: str) -> list[str]:
  """Prints one line for the ELF file NAME; returns its failures."""
  elf = ELFFile(io.BytesIO(data))
  arch = ARCHES.get(elf['e_machine'])
  if arch is None:
    return [f'{name}: unknown architecture {elf["e_machine"]}']
  limits = policy_limits(policy, arch)
  highest = needed_versions(elf)
  shown = ', '.join(
    f'{highest.get(prefix, f"no {prefix}_")} (<= {limits[prefix]})'
    for prefix in PREFIXES
  )
  print(f'{name} ({arch}): {shown}; needs {", ".join(needed_libraries(elf))}')
  failures = [
    f'{name}: needs {version}, newer than {policy} allows ({limits[prefix]})'
    for prefix, version in highest.items()
    if version_key(version) > version_key(limits[prefix])
  ]
  failures += [f'{name}: {problem}' for problem in symbol_problems(elf)]
  return failures


def main() -> int:
  """Checks every ELF file of every wheel named; 1 if any fails."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('wheels', nargs='+', help='wheels (.whl) to check')
  parser.add_argument('--policy', default='manylinux_2_27')
  args = parser.parse_args()
  failures = []
  for wheel in args.wheels:
    failures += check_wheel_name(wheel, args.policy)
    with zipfile.ZipFile(wheel) as archive:
      for member in archive.namelist():
        data = archive.read(member)
        if data[:4] == b'\x7fELF':
          failures += check_library(member, data, args.policy)
  for failure in failures:
    print(f'FAILED: {failure}', file=sys.stderr)
  return 1 if failures else 0


if __name__ == '__main__':
  sys.exit(main())
