"""The labelled intent set and the tool that trains streamserver/intent/intent_model.npz from it."""
