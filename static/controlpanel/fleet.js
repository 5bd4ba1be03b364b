// The fleet table's tools, all in the page: sort by a column, filter by model, state, role
// and text, select rows for a bulk drain or activate. The live feed replaces rows in place and
// then fires "fleet:updated", after which the current sort and filters are applied again.
(function () {
  "use strict";
  var table = document.getElementById("fleet-table");
  if (!table) return;
  var tbody = document.getElementById("fleet-rows");
  var model = document.getElementById("filter-model");
  var state = document.getElementById("filter-state");
  var role = document.getElementById("filter-role");
  var text = document.getElementById("filter-text");
  var pickedCount = document.getElementById("picked-count");
  var sortKey = null;
  var sortDir = 1;
  var SEVERITY = { bad: 0, warn: 1, ok: 2 };
  var COLUMNS = {};
  table.querySelectorAll("thead th").forEach(function (th, index) {
    if (th.dataset.sort) COLUMNS[th.dataset.sort] = index;
  });

  function sortValue(row, key) {
    if (key === "name") return row.dataset.name.toLowerCase();
    if (key === "models") return row.dataset.models;
    if (key === "role") return row.dataset.role;
    if (key === "severity") return SEVERITY[row.dataset.severity];
    var cell = row.children[COLUMNS[key]];
    var value = cell ? parseFloat(cell.dataset.sortValue) : NaN;
    return isNaN(value) ? -1 : value;
  }

  function applySort() {
    if (!sortKey) return;
    var rows = Array.from(tbody.children);
    rows.sort(function (a, b) {
      var x = sortValue(a, sortKey), y = sortValue(b, sortKey);
      return (x < y ? -1 : x > y ? 1 : 0) * sortDir;
    });
    rows.forEach(function (row) { tbody.appendChild(row); });
  }

  function shown(row) {
    var wantModel = model.value, wantState = state.value, words = text.value.trim().toLowerCase();
    if (wantModel && (" " + row.dataset.models).indexOf(" " + wantModel + " ") < 0) return false;
    if (wantState === "attention" && row.dataset.severity === "ok") return false;
    if (wantState && wantState !== "attention" && row.dataset.state !== wantState) return false;
    if (role.value && row.dataset.role !== role.value) return false;
    return !words || row.dataset.text.toLowerCase().indexOf(words) >= 0;
  }

  function applyFilter() {
    Array.from(tbody.children).forEach(function (row) {
      row.hidden = !shown(row);
      var box = row.querySelector("input[name=worker]");
      if (row.hidden && box) box.checked = false; // a hidden row is never acted on
    });
    countPicked();
  }

  function countPicked() {
    pickedCount.textContent = tbody.querySelectorAll("input[name=worker]:checked").length;
  }

  function refresh() { applySort(); applyFilter(); }

  table.querySelectorAll("thead th[data-sort]").forEach(function (th) {
    th.classList.add("sortable-col");
    th.addEventListener("click", function () {
      sortDir = sortKey === th.dataset.sort ? -sortDir : 1;
      sortKey = th.dataset.sort;
      table.querySelectorAll("thead th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", sortDir > 0 ? "ascending" : "descending");
      refresh();
    });
  });
  [model, state, role].forEach(function (el) { el.addEventListener("change", applyFilter); });
  text.addEventListener("input", applyFilter);
  tbody.addEventListener("change", countPicked);
  var all = table.querySelector("[data-testid=pick-all]");
  if (all) all.addEventListener("change", function () {
    Array.from(tbody.children).forEach(function (row) {
      var box = row.querySelector("input[name=worker]");
      if (box && !row.hidden) box.checked = all.checked;
    });
    countPicked();
  });
  document.addEventListener("fleet:updated", refresh);
  refresh();
})();

// The policy form: each policy's own knobs as the config's hint, from the policy itself.
document.querySelectorAll("select.policy-select").forEach(function (select) {
  select.addEventListener("change", function () {
    var form = select.form, option = select.selectedOptions[0];
    form.querySelector("input.policy-config").placeholder = option.dataset.example;
    form.querySelector(".policy-keys").textContent = option.dataset.keys
      ? "knobs: " + option.dataset.keys : "no knobs: leave empty";
  });
});
