import logging

logger = logging.getLogger("livekit.plugins.intone")
