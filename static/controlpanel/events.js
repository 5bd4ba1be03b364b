// The events page, live: the live feed (live.js) says when the log's newest id moved, and
// this fetches the events newer than the page's newest, with the page's own filters, as
// rows rendered by the same partial template as the first load, and puts them on top.
(function () {
  "use strict";
  var list = document.getElementById("event-rows");
  if (!list) return;
  var latest = parseInt(list.dataset.latest, 10) || 0;
  var limit = parseInt(list.dataset.limit, 10) || 200;
  var fetching = false;
  var wanted = 0;

  function newest() {
    var first = list.querySelector("li[data-event-id]");
    return first ? Math.max(latest, parseInt(first.dataset.eventId, 10)) : latest;
  }

  // The kind and actor lists hold what the log holds: a live row of a kind or by an actor
  // not in them yet adds it (actors newest first, as the page lists them; kinds at the end).
  function offer(name, value, label, first) {
    var select = document.querySelector('form.event-filters select[name="' + name + '"]');
    if (!select || !value) return;
    var known = Array.from(select.options).some(function (option) { return option.value === value; });
    if (known) return;
    var option = new Option(label || value, value);
    select.insertBefore(option, first ? select.options[1] || null : null);
  }

  function fetchNewer() {
    if (fetching) return;
    fetching = true;
    var after = newest();
    var query = list.dataset.query ? list.dataset.query + "&" : "";
    fetch(location.pathname + "?" + query + "partial=1&after=" + after, { credentials: "same-origin" })
      // A login page (the session ended) is not rows: keep the list as it is.
      .then(function (answer) { return answer.ok && !answer.redirected ? answer.text() : ""; })
      .then(function (html) {
        var holder = document.createElement("ul");
        holder.innerHTML = html.trim();
        var rows = Array.from(holder.children);
        if (rows.length) {
          var empty = list.querySelector("li.empty");
          if (empty) empty.remove();
        }
        rows.reverse().forEach(function (row) {
          if (document.querySelector('#event-rows li[data-event-id="' + row.dataset.eventId + '"]')) return;
          row.classList.add("fresh");
          list.insertBefore(row, list.firstChild);
          offer("kind", row.dataset.kind, row.dataset.kindLabel, false);
          offer("actor", row.dataset.actor, row.dataset.actor, true);
        });
        var all = list.querySelectorAll("li[data-event-id]");
        for (var i = limit; i < all.length; i++) all[i].remove();
        latest = Math.max(latest, after);
      })
      .catch(function () { /* the next message from the feed tries again */ })
      .then(function () {
        fetching = false;
        if (wanted > newest()) fetchNewer();
      });
  }

  document.addEventListener("live:message", function (event) {
    var id = event.detail && event.detail.events;
    if (typeof id !== "number") return;
    wanted = Math.max(wanted, id);
    if (id > newest()) fetchNewer();
  });
})();
