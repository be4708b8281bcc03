"""A client generated from the served OpenAPI document with openapi-python-client: it generates
without warnings, has exactly one status enum (PetStatus) that the list filter, NewPet and Pet all
use, and that enum works against a real gunicorn (create an animal, list by status).

The generated package is imported only in child processes, so this test process's modules stay
as they were; those children run with -W error, as pytest here turns warnings into errors."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import IN_POSTGRESQL_PASS

from animal_store import create_app
from animal_store.extensions import db

# Checked without importing it: the generator runs in child processes only.
pytestmark = [
    IN_POSTGRESQL_PASS,
    pytest.mark.skipif(
        importlib.util.find_spec("openapi_python_client") is None,
        reason="openapi-python-client is not installed (pip install -e '.[test]')",
    ),
]

PACKAGE = "animal_store_client"
PET_STATUS = f"{PACKAGE}.models.pet_status.PetStatus"
STATUSES = ["available", "pending", "sold"]

# Every Enum the generated package defines, and the enums in each status annotation, as
# module-qualified names: a class has one such name per process, so equal names are one type.
INSPECT = textwrap.dedent(
    """
    import enum, importlib, json, pkgutil, sys, typing

    package = importlib.import_module(sys.argv[1])
    list_pets = importlib.import_module(f"{package.__name__}.api.pets.list_pets")
    models = importlib.import_module(f"{package.__name__}.models")

    def name(cls):
        return f"{cls.__module__}.{cls.__qualname__}"

    def is_enum(value):
        return isinstance(value, type) and issubclass(value, enum.Enum)

    enums = {}
    for found in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for value in vars(importlib.import_module(found.name)).values():
            if is_enum(value) and value.__module__.startswith(package.__name__ + "."):
                enums[name(value)] = [member.value for member in value]

    annotated = {
        f"list_pets.{function}(status)": typing.get_type_hints(getattr(list_pets, function))
        for function in ("sync", "sync_detailed", "asyncio", "asyncio_detailed")
    }
    annotated |= {f"{model}.status": typing.get_type_hints(getattr(models, model))
                  for model in ("NewPet", "Pet")}
    status_types = {
        place: [name(arg) for arg in typing.get_args(hints["status"]) if is_enum(arg)]
        for place, hints in annotated.items()
    }
    print(json.dumps({"enums": enums, "status_types": status_types}))
    """
)

# Uses the generated client as a caller would: enum members in, enum members out.
USE = textwrap.dedent(
    """
    import importlib, json, sys

    package_name, base_url, token = sys.argv[1:]
    package = importlib.import_module(package_name)
    create_pet = importlib.import_module(f"{package_name}.api.pets.create_pet")
    list_pets = importlib.import_module(f"{package_name}.api.pets.list_pets")
    models = importlib.import_module(f"{package_name}.models")
    PetStatus = models.PetStatus

    def described(pet):
        return {
            "name": pet.name,
            "status_type": f"{type(pet.status).__module__}.{type(pet.status).__qualname__}",
            "status": str(pet.status),
            "is_available_member": pet.status is PetStatus.AVAILABLE,
        }

    def expect(response, code):
        # Documented errors parse into an Error model rather than raising: fail with the body.
        if response.status_code != code:
            sys.exit(f"{response.status_code}, not {code}: {response.content!r}")
        return response.parsed

    with package.AuthenticatedClient(
        base_url=base_url, token=token, raise_on_unexpected_status=True, timeout=10
    ) as client:
        created = expect(create_pet.sync_detailed(
            client=client,
            body=models.NewPet(name="Rex", category_id=1, status=PetStatus.AVAILABLE),
        ), 201)
        expect(create_pet.sync_detailed(
            client=client, body=models.NewPet(name="Tom", category_id=2, status=PetStatus.SOLD)
        ), 201)
        listed = expect(list_pets.sync_detailed(client=client, status=PetStatus.AVAILABLE), 200)
    print(json.dumps({
        "created": described(created),
        "listed": [described(pet) for pet in listed],
    }))
    """
)


def run_python(script, *args, pythonpath):
    """Run a script in a child Python that imports the generated package from `pythonpath`."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")])
        ),
    }
    completed = subprocess.run(
        [sys.executable, "-W", "error", "-c", script, *args],
        cwd=pythonpath,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def generate(document_path, output_path, *options):
    # --path, never --url: generation reads only the local file and downloads nothing.
    # post_hooks [] skips the default ruff runs, which need ruff on PATH and only restyle the code.
    config = document_path.with_name("generator-config.json")
    config.write_text(json.dumps({"post_hooks": []}))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(document_path),
            "--output-path",
            str(output_path),
            "--meta",
            "none",
            "--config",
            str(config),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def document_path(tmp_path_factory):
    """The document as the app serves it; serving it reads no database, so a module-wide app on
    an unused SQLite path gives the same document as the per-test one, once."""
    directory = tmp_path_factory.mktemp("generated-client")
    app = create_app({"TESTING": True, "DATABASE_URL": f"sqlite:///{directory / 'unused.sqlite3'}"})
    response = app.test_client().get("/v1/openapi.json")
    with app.app_context():
        db.engine.dispose()
    assert response.status_code == 200
    path = directory / "openapi.json"
    path.write_bytes(response.data)
    return path


@pytest.fixture(scope="module")
def client_dir(document_path):
    """The directory that holds the generated package."""
    generated = generate(document_path, document_path.parent / PACKAGE)
    assert generated.returncode == 0, generated.stdout + generated.stderr
    return document_path.parent


@pytest.fixture(scope="module")
def inspected(client_dir):
    return run_python(INSPECT, PACKAGE, pythonpath=client_dir)


def test_generate_with_fail_on_warning_succeeds(document_path, tmp_path):
    # A warning means the generator skipped or guessed at part of the document.
    generated = generate(document_path, tmp_path / PACKAGE, "--fail-on-warning")
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert "Warning" not in generated.stdout + generated.stderr


def test_generate_defines_exactly_one_status_enum(inspected):
    # Any enum holding a status value counts: a second, partial copy is still a second type.
    status_enums = {
        name: values for name, values in inspected["enums"].items() if set(values) & set(STATUSES)
    }
    assert status_enums == {PET_STATUS: STATUSES}


@pytest.mark.parametrize(
    "place",
    [
        "list_pets.sync(status)",
        "list_pets.sync_detailed(status)",
        "list_pets.asyncio(status)",
        "list_pets.asyncio_detailed(status)",
        "NewPet.status",
        "Pet.status",
    ],
)
def test_status_annotation_uses_pet_status(inspected, place):
    assert inspected["status_types"][place] == [PET_STATUS]


@pytest.fixture
def used(client_dir, start_gunicorn, api_key):
    """What the generated client got back from a real gunicorn: one available and one sold animal
    created with enum members, then the list filtered by PetStatus.AVAILABLE."""
    server = start_gunicorn(workers=1)
    return run_python(USE, PACKAGE, f"{server.url}/v1", api_key, pythonpath=client_dir)


def test_create_pet_with_enum_member_returns_that_member(used):
    assert used["created"] == {
        "name": "Rex",
        "status_type": PET_STATUS,
        "status": "available",
        "is_available_member": True,
    }


def test_list_pets_filtered_by_enum_member_returns_only_that_status(used):
    # The sold animal is left out, so the member reached the server as the filter's value.
    assert [
        (pet["name"], pet["status_type"], pet["is_available_member"]) for pet in used["listed"]
    ] == [("Rex", PET_STATUS, True)]
