"""Real engine payloads, byte for byte, for the tests of the decoders, the bridge and the fuzzers."""

#: A real vLLM 0.33.0 KVEventBatch as published by its ZmqEventPublisher (docs/ingesting.md,
#: "Capture file format", shows the same batch as a capture line):
#: [ts, [BlockStored(2 hashes, STORAGE, kvcr), BlockRemoved(GPU), AllBlocksCleared], dp rank 0].
VLLM_PAYLOAD = bytes.fromhex(
    "93cb41da556e4000000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1a1eb4e3edd9361acf"
    "d41bc1f76b956ddeb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f7369"
    "7a6504a76c6f72615f6964c0a66d656469756da753544f52414745a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f6361"
    "6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ea96f776e657273686970a46b76637284a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f68617368657391cf1a1eb4e3edd9361aa66d656469756da3475055a967726f75705f6964780081a474"
    "797065b0416c6c426c6f636b73436c656172656400")
