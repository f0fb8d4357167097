#!/usr/bin/env python3
"""read_tfevents.py: an independent reader of TensorBoard event files for the tests.

Usage: read_tfevents.py EVENTS_FILE

Checks the TFRecord framing of every record (uint64 length, masked CRC32C of the length, data,
masked CRC32C of the data), decodes each tensorflow.Event with a generic protobuf wire-format
decoder and prints `file_version <version>` for a file_version event and `<step> <tag> <value>`
for each scalar (value: repr of the float32 simple_value). Exits 1 with a message on any error.
Standard library only: no tensorflow, tensorboard or protobuf.
"""
import struct
import sys


def crc32c(data):
    """CRC32C (Castagnoli), bit by bit: reflected polynomial 0x82F63B78."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class FormatError(Exception):
    pass


def read_varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise FormatError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise FormatError("varint longer than 10 bytes")


def decode_message(buf):
    """Returns {field number: [(wire type, raw value)]}: an int for varints, bytes otherwise."""
    fields, pos = {}, 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise FormatError("truncated fixed%d field %d" % (size * 8, field))
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 2:
            size, pos = read_varint(buf, pos)
            if pos + size > len(buf):
                raise FormatError("truncated length-delimited field %d" % field)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise FormatError("unsupported wire type %d (field %d)" % (wire, field))
        fields.setdefault(field, []).append((wire, value))
    return fields


def last(fields, number, wire):
    """The last value of field `number`, checking its wire type; None when absent."""
    values = fields.get(number)
    if not values:
        return None
    if values[-1][0] != wire:
        raise FormatError("field %d has wire type %d, expected %d" % (number, values[-1][0], wire))
    return values[-1][1]


def read_records(data):
    pos, index = 0, 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise FormatError("record %d: truncated header at byte %d" % (index, pos))
        length_bytes = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if length_crc != masked_crc32c(length_bytes):
            raise FormatError("record %d: length CRC mismatch at byte %d" % (index, pos))
        start = pos + 12
        if start + length + 4 > len(data):
            raise FormatError("record %d: truncated data at byte %d" % (index, start))
        payload = data[start:start + length]
        (data_crc,) = struct.unpack("<I", data[start + length:start + length + 4])
        if data_crc != masked_crc32c(payload):
            raise FormatError("record %d: data CRC mismatch at byte %d" % (index, start))
        yield payload
        pos, index = start + length + 4, index + 1


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: read_tfevents.py EVENTS_FILE\n")
        return 2
    try:
        with open(argv[1], "rb") as f:
            data = f.read()
        lines = []
        for payload in read_records(data):
            event = decode_message(payload)
            version = last(event, 7, 2)
            if version is not None:
                lines.append("file_version %s" % version.decode("utf-8"))
            step = last(event, 2, 0) or 0
            if step >= 1 << 63:  # int64 is sent as its two's complement
                step -= 1 << 64
            for wire, summary in event.get(5, []):
                if wire != 2:
                    raise FormatError("summary field has wire type %d" % wire)
                for vwire, value in decode_message(summary).get(1, []):
                    if vwire != 2:
                        raise FormatError("summary value has wire type %d" % vwire)
                    fields = decode_message(value)
                    tag = (last(fields, 1, 2) or b"").decode("utf-8")
                    simple = last(fields, 2, 5)
                    if simple is not None:
                        lines.append("%d %s %r" % (step, tag, struct.unpack("<f", simple)[0]))
    except (OSError, FormatError, UnicodeDecodeError) as e:
        sys.stderr.write("read_tfevents.py: %s: %s\n" % (argv[1], e))
        return 1
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
