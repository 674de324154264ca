// Run metadata shared by the pages: config keys and values, and what a tag may be.

/** fp8_protocol.runs.TAG_PATTERN (the service checks it too). */
export const TAG_RE = /^[\w.:/=+@-]{1,64}$/;

/** Tags typed as text (space- or comma-separated): {tags} or {error} naming the first that is not a tag. */
export function parseTags(text) {
  const tags = text.split(/[\s,]+/).filter(Boolean);
  const bad = tags.find((t) => !TAG_RE.test(t));
  return bad === undefined ? { tags } : { error: `"${bad}" is not a tag (1-64 letters, digits or _-.:/=+@)` };
}

/** "a.b" -> value for every leaf of a nested config. */
export function flattenConfig(config, prefix = "", out = []) {
  for (const [k, v] of Object.entries(config || {})) {
    const key = prefix ? `${prefix}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length) flattenConfig(v, key, out);
    else out.push([key, v]);
  }
  return out;
}

export function configText(v) {
  if (v === undefined) return "–";
  return typeof v === "string" ? v : JSON.stringify(v);
}

/** The value at "a.b.c" of a nested config (undefined when absent). */
export function configValue(config, key) {
  let node = config;
  for (const part of key.split(".")) {
    if (!node || typeof node !== "object" || !(part in node)) return undefined;
    node = node[part];
  }
  return node;
}
