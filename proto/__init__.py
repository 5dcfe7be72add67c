"""polyserve wire contracts: msgspec structs, versioned subjects, Redis keys."""
from polyserve.proto.messages import *  # noqa: F401,F403
from polyserve.proto.subjects import Keys, Subjects  # noqa: F401
