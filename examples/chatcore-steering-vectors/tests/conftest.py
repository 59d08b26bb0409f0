import pytest

# chatcore's fixtures: chatcore_engine, chatcore_conversation, chatcore_tiny_model, ...
pytest_plugins = ["chatcore.pytest_plugin"]


@pytest.fixture
def chatcore_plugins():
    """The plugins under test: every chatcore_engine registers these (and no installed plugin)."""
    return ("chatcore_steering_vectors",)
