"""Where a person's things are on this host: their registry entry (identity/person_registry.py), built from the
settings, and the part of the shared volume their kernels mount.

Callers: the gateway's kernel manager (a start's volume, from the caller), the provisioner and the pool's hand-out
(the directories a sandbox shows, from its StartRequest's owner), labroot.py (a person's Lab root), the MCP file tools
and the shipped Hub config's hook for SimpleLocalProcessSpawner's homes.
"""

from __future__ import annotations

import functools
from pathlib import Path

from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import Owner, Person
from msb_kernels.identity.person_registry import PersonRegistry, Registered
from msb_kernels.identity.volumes import WHOLE_VOLUME, has_own_directory, own_volume
from msb_kernels.settings.config import MsbSettings
from msb_kernels.settings.value_checks import PERSON_FIELD


def lab_roots_parent(settings: MsbSettings) -> Path | None:
    """The directory each person's Lab root is made in (MSB_LAB_ROOT_PATH=<parent>/{username}), resolved once, as
    the settings' check found it; None without {username}."""
    template = settings.lab_root_path
    if not template or PERSON_FIELD not in template:
        return None
    return Path(template.replace(PERSON_FIELD, "_")).resolve().parent


def people_of(settings: MsbSettings) -> PersonRegistry:
    """The person registry of these settings' state directory (one per process and place: its entries are cached)."""
    places = tuple(place for place in (settings.shared_volume, lab_roots_parent(settings)) if place is not None)
    return _registry(settings.state_root(), places, settings.host_accounts)


@functools.cache
def _registry(state_dir: Path, places: tuple[Path, ...], accounts: str | None) -> PersonRegistry:
    return PersonRegistry(state_dir, places, accounts)


def volume_key(settings: MsbSettings, person: Person) -> str:
    """A start's volume for the caller (StartRequest.volume): their key, or the whole volume for the single token's
    person, the desktop's one user and the system (the pool)."""
    entry = person_for(settings, person)
    return entry.key if entry is not None else WHOLE_VOLUME


def whose(settings: MsbSettings, owner: Owner | None, volume: str | None) -> Registered | None:
    """The person whose own directories a start shows (its StartRequest's owner, where its volume is their own); None
    for the host's own user's kernels (the whole volume, or none asked). The owner decides, not the volume's name: a
    record from before keys held a name there."""
    if volume in (None, WHOLE_VOLUME):
        return None
    if owner is None:  # a person's volume with nobody's name on it: nothing of anyone's, rather than the whole volume
        raise InvalidRequest(f"the start request's volume {volume!r} has no owner")
    return people_of(settings).get(owner)


def person_for(settings: MsbSettings, person: Person | None) -> Registered | None:
    """``whose`` for a caller rather than a start (the MCP file tools)."""
    if person is None or not has_own_directory(person):
        return None
    return people_of(settings).get(person.owner)


def volume_directory(settings: MsbSettings, volume: str | None, person: Registered | None) -> Path | None:
    """The host directory a kernel mounts as its shared volume, by its StartRequest's volume and whose it is
    (``whose``): none, the whole volume, or its person's own, made on first use (volumes.own_volume)."""
    root = settings.shared_volume
    if root is None or volume is None:
        return None
    return root if person is None else own_volume(root, person, people_of(settings))
