"""The numpy reference: the decoder (:mod:`.decoder`, its layers in :mod:`.layers`) and the
encoder (:mod:`.encoder`), written from the models' definitions for the fast paths to be held
to."""
