// A minimal GGUF (v2/v3) header reader for the browser tests: the metadata keys, and a copy of a
// file without some of them (tensor infos and data unchanged: tensor offsets are relative to the
// data section, which is re-aligned after the shorter header).
//
//   node tests/browser/gguf.mjs FILE                      print the metadata keys
//   import { ggufKeys, ggufWithout } from "./gguf.mjs"

import fs from "node:fs";

// Value type -> size in bytes of fixed-size types (8 = string, 9 = array are variable).
const SIZES = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };

function parse(buf) {
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  let o = 0;
  const u32 = () => {
    o += 4;
    return view.getUint32(o - 4, true);
  };
  const u64 = () => {
    o += 8;
    return Number(view.getBigUint64(o - 8, true));
  };
  const str = () => {
    const n = u64();
    o += n;
    return buf.subarray(o - n, o).toString("utf8");
  };
  const skipValue = (type) => {
    if (type === 8) str();
    else if (type === 9) {
      const t = u32();
      const n = u64();
      if (t in SIZES) o += SIZES[t] * n;
      else for (let i = 0; i < n; i++) skipValue(t);
    } else if (type in SIZES) o += SIZES[type];
    else throw new Error(`unknown GGUF value type ${type}`);
  };
  if (buf.subarray(0, 4).toString("latin1") !== "GGUF") throw new Error("not a GGUF file");
  o = 4;
  const version = u32();
  if (version < 2) throw new Error(`GGUF v${version} is not supported here`);
  const nTensors = u64();
  const nKv = u64();
  const kvs = [];
  for (let i = 0; i < nKv; i++) {
    const start = o;
    const key = str();
    const type = u32();
    let value;
    if (key === "general.alignment") value = view.getUint32(o, true);
    skipValue(type);
    kvs.push({ key, type, value, start, end: o });
  }
  const tensorsStart = o;
  for (let i = 0; i < nTensors; i++) {
    str();
    const nDims = u32();
    o += 8 * nDims + 4 + 8;
  }
  const alignment = kvs.find((k) => k.key === "general.alignment")?.value || 32;
  const dataStart = Math.ceil(o / alignment) * alignment;
  return { version, nTensors, kvs, tensorsStart, tensorsEnd: o, alignment, dataStart };
}

/** The metadata keys of a GGUF file's bytes. */
export function ggufKeys(buf) {
  return parse(buf).kvs.map((k) => k.key);
}

/** One metadata entry's bytes: key, type (8: a string; 4: a u32 for a number), value. */
function entry(key, value) {
  const str = (s) => {
    const bytes = Buffer.from(s, "utf8");
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(bytes.length));
    return [len, bytes];
  };
  const type = Buffer.alloc(4);
  if (typeof value === "number") {
    type.writeUInt32LE(4);
    const v = Buffer.alloc(4);
    v.writeUInt32LE(value);
    return Buffer.concat([...str(key), type, v]);
  }
  type.writeUInt32LE(8);
  return Buffer.concat([...str(key), type, ...str(value)]);
}

/**
 * A copy of the GGUF bytes `buf` without the metadata keys for which `drop(key)` is true, and
 * with the entries `add` ({key: string or u32}) after the rest (a key of both is replaced).
 */
export function ggufWithout(buf, drop, add = {}) {
  const g = parse(buf);
  const kept = g.kvs.filter((k) => !drop(k.key) && !(k.key in add));
  const added = Object.entries(add).map(([key, value]) => entry(key, value));
  const head = Buffer.alloc(24);
  buf.copy(head, 0, 0, 16); // magic, version, tensor count
  head.writeBigUInt64LE(BigInt(kept.length + added.length), 16);
  const parts = [
    head,
    ...kept.map((k) => buf.subarray(k.start, k.end)),
    ...added,
    buf.subarray(g.tensorsStart, g.tensorsEnd),
  ];
  const headerLen = parts.reduce((s, p) => s + p.length, 0);
  parts.push(Buffer.alloc(Math.ceil(headerLen / g.alignment) * g.alignment - headerLen));
  parts.push(buf.subarray(g.dataStart));
  return Buffer.concat(parts);
}

if (process.argv[1] && import.meta.url.endsWith(process.argv[1].split("/").pop())) {
  for (const key of ggufKeys(fs.readFileSync(process.argv[2]))) console.log(key);
}
