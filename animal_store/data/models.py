"""Storage: the animals and the API keys, portable between SQLite and PostgreSQL."""

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import (
    BigInteger,
    DateTime,
    Enum,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from animal_store.extensions import Base, db

if TYPE_CHECKING:
    # Flask-SQLAlchemy makes db.Model at run time, from Base: the checker sees a variable, not a
    # class, so it checks the models against Base, whose mappings and registry db.Model has.
    Model = Base
else:
    Model = db.Model

# BIGINT identity on PostgreSQL; on SQLite only INTEGER PRIMARY KEY is the 64-bit rowid.
Int64Id = BigInteger().with_variant(Integer, "sqlite")

PET_STATUSES = ("available", "pending", "sold")


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC datetime on every backend; SQLite alone would hand back naive ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=value.tzinfo or UTC)


class Pet(Model):
    __tablename__ = "pets"

    # No identity: on PostgreSQL a trigger takes ids in order (keyset.py).
    id: Mapped[int] = mapped_column(Int64Id, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    category_id: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str | None] = mapped_column(
        Enum(*PET_STATUSES, name="pet_status", native_enum=False, create_constraint=True)
    )

    # Serves the keyset walk filtered by status: WHERE status = ? AND id > ? ORDER BY id.
    __table_args__ = (Index("ix_pets_status_id", "status", "id"),)


class ApiKey(Model):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Int64Id, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # The first characters of the key, enough for a person to tell keys apart.
    prefix: Mapped[str] = mapped_column(String(16))
    # SHA-256 of the whole key; the key itself is never stored.
    key_hash: Mapped[bytes] = mapped_column(LargeBinary(32), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Requests this key may make, in the notation of `limits` ("100/second"); NULL: RATE_LIMIT.
    rate_limit: Mapped[str | None] = mapped_column(String(100))
    # What the key may do: "read" (listPets, getPet), "write" (createPet), comma-separated.
    scopes: Mapped[str] = mapped_column(String(50), server_default="read,write")
    # From then on the key is refused like a revoked one; NULL: never.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The key this one replaced (`keys rotate`): it works, with the same name, scopes and limit,
    # until previous_key_expires_at.
    previous_key_hash: Mapped[bytes | None] = mapped_column(LargeBinary(32), unique=True)
    previous_prefix: Mapped[str | None] = mapped_column(String(16))
    previous_key_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class IdempotencyRecord(Model):
    """One Idempotency-Key of one API key on one method and path: claimed while its request runs,
    then its answer."""

    __tablename__ = "idempotency_records"
    # The unique constraint, not process memory, decides which of several racing requests runs.
    __table_args__ = (
        UniqueConstraint("api_key_id", "target_hash", "key", name="uq_idempotency_records_key"),
    )

    id: Mapped[int] = mapped_column(Int64Id, Identity(), primary_key=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    # SHA-256 of the request's method and path (idempotency.request_target): a key is scoped to
    # the request it was first used with.
    target_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    key: Mapped[str] = mapped_column(String(255))
    # SHA-256 of the parsed request body in canonical JSON: the same key must mean the same body.
    fingerprint: Mapped[bytes] = mapped_column(LargeBinary(32))
    # Random per claim, so only the request that holds the claim can complete or release it.
    claim: Mapped[str] = mapped_column(String(32))
    claimed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    # NULL while the request is in flight; then the answer that replays are given.
    response_status: Mapped[int | None] = mapped_column(SmallInteger)
    response_body: Mapped[bytes | None] = mapped_column(LargeBinary)
    response_location: Mapped[str | None] = mapped_column(Text)
